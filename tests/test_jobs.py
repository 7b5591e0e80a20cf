"""Long calls (proxy/jobs.py, proxy/operations.py): 202 at once, the operation resource,
SSE, retries, dead operations, cancels.

In-process proxies on the memory and SQLite stores, against real upstream servers;
tests/test_jobs_replicas.py runs real ``tool-proxy serve`` processes on one Redis.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from proxy import jobs as jobs_module
from proxy.auth.sealing import Sealer
from proxy.cli import main as cli_main
from proxy.config import parse_config
from proxy.errors import ConfigError, OffloadUnavailable, StoredRequestUnreadable, StoreUnavailable
from proxy.job_events import Hub
from proxy.jobs import (
    JOB_OWNER,
    RouteJobs,
    StoredRequest,
    asked,
    decode_request,
    encode_request,
    preferences,
    requeue,
    unsealed,
)
from proxy.store import Job, JobState, RecordKey, State
from proxy.store.memory import MemoryQueue, MemoryStore
from proxy.store.queue import new_job_id
from tests.conftest import SEALING_ENV, Clock, ProxyFactory, new_key, route
from tests.idp import IdentityProvider
from tests.servers import CountingTool, ThreadServer, running, wait_for
from tests.test_auth import auth_config
from tests.test_offload import S3, s3, s3_offload  # noqa: F401 (s3 is a fixture)

BODY = {"repo": "tool-proxy", "pr": 12}
ASYNC = {"Prefer": "respond-async"}


def long_route(upstream: str, *, query: str = "", **config: Any) -> dict[str, Any]:
    spec = route(upstream)
    spec["async"] = {
        "backoff": "50ms",
        "backoff_max": "100ms",
        "visibility": "2s",
        **config.pop("async_", {}),
    }
    spec.update(config)
    return spec


def post(
    base: str, body: Any = BODY, key: str | None = None, query: str = "", **headers: str
) -> httpx.Response:
    sent = {"content-type": "application/json", "idempotency-key": key or new_key(body)}
    sent.update(headers)
    return httpx.post(f"{base}/tools/run{query}", content=json.dumps(body), headers=sent)


def until(base: str, location: str, *states: str) -> dict[str, Any]:
    """The status document once the operation is in one of ``states``."""
    seen: dict[str, Any] = {}

    def reached() -> bool:
        answer = httpx.get(base + location)
        seen.update(answer.json())
        return seen["state"] in states

    wait_for(reached, what=f"operation {location} to be {'/'.join(states)}")
    return seen


class FlakyTool:
    """Answers 503 (Retry-After: 0) to the first ``failures`` calls of each key, then 200;
    ``failures`` < 0: always 503."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: Counter[str] = Counter()
        self.app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["POST"])])

    async def handle(self, request: Request) -> Response:
        key = request.headers["idempotency-key"]
        self.calls[key] += 1
        if self.failures < 0 or self.calls[key] <= self.failures:
            return Response(b"busy", 503, headers={"Retry-After": "0"})
        return Response(json.dumps({"calls": self.calls[key]}), media_type="application/json")


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    if request.param == "postgres":
        url: str = request.getfixturevalue("postgres_url")
        return url
    return "memory://" if request.param == "memory" else f"sqlite://{tmp_path}/state.db"


@pytest.fixture
def flaky() -> Iterator[FlakyTool]:
    tool = FlakyTool(2)
    server = ThreadServer(tool.app).start()
    tool.url = server.url  # type: ignore[attr-defined]
    yield tool
    server.stop()


# -- asking for it ------------------------------------------------------------------------


def test_prefer_header_parsing() -> None:
    assert preferences("respond-async, wait=10") == (True, 10.0)
    assert preferences("wait=5;x=1, RESPOND-ASYNC") == (True, 5.0)
    assert preferences('return=minimal, wait="3"') == (False, 3.0)
    assert preferences(None) == (False, None)
    assert preferences("wait=soon") == (False, None)


def test_modes_and_after() -> None:
    def config(**section: Any) -> Any:
        spec = route("http://tool:1")
        spec["async"] = {"visibility": "1s", **section}
        async_ = (
            parse_config({"store": {"url": "memory://"}, "routes": [spec]}, env={}).routes[0].async_
        )
        assert async_ is not None
        return async_

    assert asked(config(mode="prefer"), None) is None
    prefer = asked(config(mode="prefer"), "respond-async")
    assert prefer is not None and (prefer.wait, prefer.preferred) == (0.0, True)
    after = asked(config(mode="prefer", after="25s"), None)
    assert after is not None and (after.wait, after.preferred) == (25.0, False)
    always = asked(config(mode="always"), "wait=2")
    assert always is not None and (always.wait, always.preferred) == (2.0, False)
    assert asked(config(mode="never"), "respond-async") is None


def test_async_needs_idempotency_and_names_the_field() -> None:
    spec = route("http://tool:1", guarded=False)
    spec["async"] = {"mode": "always"}
    with pytest.raises(ConfigError, match="async: needs idempotency"):
        parse_config({"routes": [spec]}, env={})
    spec = route("http://tool:1")  # lock_ttl 5s
    spec["async"] = {}
    with pytest.raises(ConfigError, match=r"async.visibility must be below .*lock_ttl"):
        parse_config({"routes": [spec]}, env={})
    spec = route("http://tool:1")
    spec["async"] = {"attempts": 0, "visibility": "1s"}
    with pytest.raises(ConfigError, match="attempts"):
        parse_config({"routes": [spec]}, env={})
    spec = route("http://tool:1")
    spec["workers"] = {"concurrency": 0}
    with pytest.raises(ConfigError, match="concurrency"):
        parse_config({"routes": [spec]}, env={})


# -- the 202 and the operation ------------------------------------------------------------


def test_a_long_call_is_accepted_then_its_result_is_the_tools_answer(
    tool: CountingTool, make_proxy: ProxyFactory, store: str
) -> None:
    proxy = make_proxy(long_route(tool.url), store=store)
    key = new_key(BODY)
    accepted = post(proxy.url, key=key, query="?delay=1.5", **ASYNC)
    assert accepted.status_code == 202, accepted.text
    assert accepted.headers["preference-applied"] == "respond-async"
    assert accepted.headers["retry-after"] == "1"
    location = accepted.headers["location"]
    assert location.startswith("/_proxy/operations/") and len(location) > 40
    doc = accepted.json()
    assert doc["id"] == location.rsplit("/", 1)[1]
    assert doc["state"] in ("queued", "running") and doc["created_at"].endswith("Z")

    again = post(proxy.url, key=key, query="?delay=1.5", **ASYNC)
    assert again.status_code == 202 and again.headers["location"] == location
    in_flight = post(proxy.url, key=key, query="?delay=1.5")  # no Prefer: as for a live call
    assert in_flight.status_code == 409

    until(proxy.url, location, "completed")
    see_other = httpx.get(proxy.url + location)
    assert see_other.status_code == 303
    assert see_other.headers["location"] == location + "/result"
    result = httpx.get(proxy.url + location + "/result")
    assert result.status_code == 200
    assert result.headers["idempotent-replayed"] == "true"
    assert result.headers["x-tool"] == "counting"
    assert result.json()["execution"] == 1 and result.json()["body"] == json.dumps(BODY)
    replay = post(proxy.url, key=key, query="?delay=1.5", **ASYNC)  # done: the recorded answer
    assert replay.status_code == 200 and replay.content == result.content
    assert tool.count(key) == 1
    plan = key.split(":", 1)[0]  # one replay served, counted once (not by the job's claim)
    (step,) = httpx.get(f"{proxy.url}/_proxy/sessions/{plan}/steps").json()["steps"]
    assert step["replays"] == 1


def test_an_answer_within_wait_is_given_at_once(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(long_route(tool.url))
    quick = post(proxy.url, **{"Prefer": "respond-async, wait=10"})
    assert quick.status_code == 200, quick.text
    assert "idempotent-replayed" not in quick.headers
    assert quick.json()["execution"] == 1
    slow = post(proxy.url, query="?delay=2", **{"Prefer": "respond-async, wait=1"})
    assert slow.status_code == 202


def test_mode_always_and_after(tool: CountingTool, make_proxy: ProxyFactory) -> None:
    always = make_proxy(long_route(tool.url, async_={"mode": "always"}))
    answer = post(always.url)
    assert answer.status_code == 202 and "preference-applied" not in answer.headers
    after = make_proxy(long_route(tool.url, async_={"after": "300ms"}))
    assert post(after.url).status_code == 200  # quick: answered as usual
    switched = post(after.url, query="?delay=2")
    assert switched.status_code == 202
    assert until(after.url, switched.headers["location"], "completed")["attempts"] == 1


def test_status_codes_of_the_operation_resource(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(long_route(tool.url))
    missing = httpx.get(proxy.url + "/_proxy/operations/nope")
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/problem+json"
    assert missing.json()["type"] == "urn:tool-proxy:problem:operation-not-found"
    location = post(proxy.url, query="?delay=1", **ASYNC).headers["location"]
    not_yet = httpx.get(proxy.url + location + "/result")
    assert not_yet.status_code == 409
    assert not_yet.json()["type"] == "urn:tool-proxy:problem:operation-state"
    bad = httpx.get(
        proxy.url + location, headers={"accept": "text/event-stream", "last-event-id": "x"}
    )
    assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["detail"]


# -- SSE ----------------------------------------------------------------------------------


def sse(base: str, location: str, last: str | None = None) -> list[tuple[str, str, dict[str, Any]]]:
    """The (event, id, data) of every event until the stream closes."""
    headers = {"accept": "text/event-stream"}
    if last is not None:
        headers["last-event-id"] = last
    events = []
    with httpx.stream("GET", base + location, headers=headers, timeout=20) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        for line in stream.iter_lines():
            if line.startswith(":"):
                continue
            if not line:
                if "data" in fields:
                    events.append((fields["event"], fields["id"], json.loads(fields["data"])))
                fields = {}
                continue
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return events


def test_sse_reports_each_state_and_a_reconnect_misses_nothing(
    tool: CountingTool, make_proxy: ProxyFactory, store: str
) -> None:
    proxy = make_proxy(long_route(tool.url), store=store)
    location = post(proxy.url, query="?delay=0.5", **ASYNC).headers["location"]
    events = sse(proxy.url, location)
    assert [e[0] for e in events] == ["state"] * len(events)
    assert [e[2]["state"] for e in events] == ["queued", "running", "completed"]
    assert [e[1] for e in events] == ["1", "2", "3"]
    assert events[-1][2]["attempts"] == 1
    missed = sse(proxy.url, location, last="1")  # dropped after the first event
    assert [(e[1], e[2]["state"]) for e in missed] == [("2", "running"), ("3", "completed")]
    assert sse(proxy.url, location, last="3") == []


# -- retries, dead operations, cancels ----------------------------------------------------


def test_a_tool_that_answers_503_twice_is_retried_and_completes(
    flaky: FlakyTool, make_proxy: ProxyFactory, store: str
) -> None:
    proxy = make_proxy(long_route(flaky.url), store=store)  # type: ignore[attr-defined]
    key = new_key(BODY)
    location = post(proxy.url, key=key, **ASYNC).headers["location"]
    doc = until(proxy.url, location, "completed", "dead", "failed")
    assert doc["state"] == "completed" and doc["attempts"] == 3
    assert httpx.get(proxy.url + location + "/result").json() == {"calls": 3}
    assert flaky.calls[key] == 3


def test_a_tool_that_always_answers_503_ends_dead_and_can_be_requeued(
    make_proxy: ProxyFactory, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool = FlakyTool(-1)
    monkeypatch.setenv("ADMIN_TOKEN", "operator-secret")
    with running(ThreadServer(tool.app)) as server:
        proxy = make_proxy(
            long_route(server.url, async_={"attempts": 3}),
            store=store,
            admin={"token_env": "ADMIN_TOKEN"},
        )
        key = new_key(BODY)
        location = post(proxy.url, key=key, **ASYNC).headers["location"]
        doc = until(proxy.url, location, "dead", "completed", "failed")
        assert doc["state"] == "dead" and doc["attempts"] == 3
        assert doc["error"]["status"] == 503 and "busy" in doc["error"]["detail"]
        assert tool.calls[key] == 3
        admin = {"authorization": "Bearer operator-secret"}
        listed = httpx.get(proxy.url + "/_proxy/admin/operations?state=dead", headers=admin)
        assert listed.status_code == 200
        assert [o["id"] for o in listed.json()["operations"]] == [doc["id"]]
        assert listed.json()["operations"][0]["key"] == key
        unauthorized = httpx.get(proxy.url + "/_proxy/admin/operations?state=dead")
        assert unauthorized.status_code == 401
        tool.failures = 0  # the tool is fixed: the operator queues it again
        requeued = httpx.post(
            proxy.url + f"/_proxy/admin/operations/{doc['id']}/requeue", headers=admin
        )
        assert requeued.status_code == 200, requeued.text
        assert until(proxy.url, location, "completed")["attempts"] == 1
        assert tool.calls[key] == 4
        again = httpx.post(
            proxy.url + f"/_proxy/admin/operations/{doc['id']}/requeue", headers=admin
        )
        assert again.status_code == 409


def test_a_dead_operation_releases_its_key(make_proxy: ProxyFactory) -> None:
    tool = FlakyTool(-1)
    with running(ThreadServer(tool.app)) as server:
        proxy = make_proxy(long_route(server.url, async_={"attempts": 1}))
        key = new_key(BODY)
        location = post(proxy.url, key=key, **ASYNC).headers["location"]
        assert until(proxy.url, location, "dead", "completed")["state"] == "dead"
        tool.failures = 0
        second = post(proxy.url, key=key, **ASYNC)  # nothing ran: a new operation runs it
        assert second.status_code == 202 and second.headers["location"] != location
        assert until(proxy.url, second.headers["location"], "completed")["attempts"] == 1
        assert tool.calls[key] == 2


def test_a_queued_operation_is_cancelled_and_a_running_one_is_not(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(long_route(tool.url, workers={"concurrency": 1}))
    running = post(proxy.url, query="?delay=1", **ASYNC).headers["location"]
    until(proxy.url, running, "running")
    queued_key = new_key(BODY)
    queued = post(proxy.url, key=queued_key, **ASYNC).headers["location"]
    assert httpx.get(proxy.url + queued).json()["state"] == "queued"
    cancelled = httpx.delete(proxy.url + queued)
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    refused = httpx.delete(proxy.url + running)
    assert refused.status_code == 409 and "un-sent" in refused.json()["detail"]
    until(proxy.url, running, "completed")
    assert httpx.get(proxy.url + queued).json()["state"] == "cancelled"
    assert tool.count(queued_key) == 0
    again = httpx.delete(proxy.url + queued)  # DELETE is idempotent
    assert again.status_code == 200 and again.json()["state"] == "cancelled"
    ended = httpx.delete(proxy.url + running)
    assert ended.status_code == 409 and "completed" in ended.json()["detail"]
    rerun = post(proxy.url, key=queued_key, **ASYNC)  # the key was released
    assert rerun.status_code == 202 and rerun.headers["location"] != queued
    until(proxy.url, rerun.headers["location"], "completed")
    assert tool.count(queued_key) == 1


# -- who may see an operation -------------------------------------------------------------


def test_only_the_principal_that_submitted_it_or_an_operator_sees_an_operation(
    tool: CountingTool,
    make_proxy: ProxyFactory,
    idp: IdentityProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ADMIN_TOKEN", "operator-secret")
    proxy = make_proxy(
        long_route(tool.url, auth={"required": True}),
        auth=auth_config(idp),
        admin={"token_env": "ADMIN_TOKEN"},
    )
    alice = {"Authorization": f"Bearer {idp.token('alice')}"}
    bob = {"Authorization": f"Bearer {idp.token('bob')}"}
    location = post(proxy.url, query="?delay=3", **ASYNC, **alice).headers["location"]
    assert httpx.get(proxy.url + location, headers=alice).status_code == 200
    assert httpx.get(proxy.url + location, headers=bob).status_code == 404
    assert httpx.delete(proxy.url + location, headers=bob).status_code == 404
    forged = {"Authorization": "Bearer not-a-token"}
    assert httpx.get(proxy.url + location, headers=forged).status_code == 401
    assert httpx.get(proxy.url + location).status_code == 401  # the route requires a token
    operator = {"Authorization": "Bearer operator-secret"}
    assert httpx.get(proxy.url + location, headers=operator).status_code == 200
    wait_for(lambda: httpx.get(proxy.url + location, headers=alice).status_code == 303)
    assert httpx.get(proxy.url + location + "/result", headers=alice).status_code == 200
    assert httpx.get(proxy.url + location + "/result", headers=bob).status_code == 404


# -- shutdown -----------------------------------------------------------------------------


def test_a_shutdown_finishes_running_calls_and_leaves_queued_ones(
    tool: CountingTool, make_proxy: ProxyFactory, tmp_path: Any
) -> None:
    store = f"sqlite://{tmp_path}/state.db"
    spec = long_route(tool.url, workers={"concurrency": 1})
    first = make_proxy(spec, store=store)
    running_key, queued_key = new_key(BODY, step=1), new_key(BODY, step=2)
    running_at = post(first.url, key=running_key, query="?delay=1", **ASYNC).headers["location"]
    wait_for(lambda: tool.arrived[running_key] == 1, what="the first call to reach the tool")
    queued_at = post(first.url, key=queued_key, **ASYNC).headers["location"]
    first.stop()  # graceful: the running call ends and is recorded; the queued one waits
    assert tool.count(running_key) == 1 and tool.arrived[queued_key] == 0

    second = make_proxy(spec, store=store)
    assert httpx.get(second.url + running_at).status_code == 303
    assert until(second.url, queued_at, "completed")["attempts"] == 1
    assert tool.count(queued_key) == 1 and tool.count(running_key) == 1


# -- large request bodies -----------------------------------------------------------------


def test_a_large_request_body_waits_in_object_storage(
    tool: CountingTool,
    make_proxy: ProxyFactory,
    s3: S3,  # noqa: F811 (the fixture)
) -> None:
    proxy = make_proxy(long_route(tool.url), offload=s3_offload(s3, threshold=1024))
    big = {"diff": "x" * 50_000}
    key = new_key(big)
    location = post(proxy.url, big, key=key, **ASYNC).headers["location"]
    until(proxy.url, location, "completed")
    assert tool.requests[-1]["body"] == json.dumps(big).encode()  # sent whole
    objects = s3.keys()
    assert any(k.startswith("responses/tool/") for k in objects)  # the request, kept there


# -- one store read per operation, however many readers -----------------------------------


class CountingQueue(MemoryQueue):
    """A memory queue that counts the event reads (a unit test's stand-in for a store)."""

    def __init__(self, clock: Any = time.time) -> None:
        super().__init__(clock)
        self.reads = 0

    async def events(self, id: str, after: int) -> list[Job] | None:
        self.reads += 1
        return await super().events(id, after)


@pytest.mark.anyio
async def test_many_readers_of_one_operation_share_one_store_read_per_change() -> None:
    queue = CountingQueue()
    hub = Hub(queue, structlog.get_logger())
    job = await queue.submit(
        Job(id="op", route="r", principal="", slot="s", name="n", label="l", keep=60)
    )
    readers = [asyncio.create_task(_states(hub, job.id)) for _ in range(50)]
    await asyncio.sleep(0.05)
    await queue.take("r", "w", 30)
    await queue.move("op", frozenset({JobState.QUEUED}), JobState.RUNNING, worker="w")
    await asyncio.sleep(0.05)
    await queue.move("op", frozenset({JobState.RUNNING}), JobState.COMPLETED, worker="w")
    states = await asyncio.gather(*readers)
    assert states == [["queued", "running", "completed"]] * 50
    assert queue.reads <= 6  # once at the start and once per change (not 50 times each)
    hub.close()


@pytest.mark.anyio
async def test_the_stream_of_an_operation_that_expired_while_queued_ends(clock: Clock) -> None:
    """Nobody took the job before it expired (``keep``): its readers' streams end,
    instead of polling the store for ever."""
    clock.now = time.time()
    queue = CountingQueue(clock)
    hub = Hub(queue, structlog.get_logger())
    job = await queue.submit(
        Job(id="op", route="r", principal="", slot="s", name="n", label="l", keep=60)
    )
    reader = asyncio.create_task(_states(hub, job.id))
    await asyncio.sleep(0.05)
    clock.now += 61
    hub.poke(job.id)
    async with asyncio.timeout(5):
        assert await reader == ["queued"]
    hub.close()


async def _states(hub: Hub, id: str) -> list[str]:
    return [event.state.value async for event in hub.follow(id, 0)]


# -- faults: a worker never dies, a recorded answer is never overwritten --------------------


def _fault_route(url: str, **async_: Any) -> dict[str, Any]:
    spec = route(url, lock_ttl="1s")
    spec["async"] = {"backoff": "50ms", "backoff_max": "100ms", "visibility": "300ms", **async_}
    spec["workers"] = {"concurrency": 1}
    return spec


def test_a_taker_keeps_the_answer_its_worker_recorded_but_could_not_report(
    tool: CountingTool, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = MemoryQueue.move
    blips: list[str] = []

    async def move(self: MemoryQueue, id: str, *args: Any, **kwargs: Any) -> Job | None:
        if args[1] is JobState.COMPLETED and not blips:  # the store blips at the last move
            blips.append(id)
            raise StoreUnavailable("blip")
        return await original(self, id, *args, **kwargs)

    monkeypatch.setattr(MemoryQueue, "move", move)
    proxy = make_proxy(_fault_route(tool.url))
    key = new_key(BODY)
    location = post(proxy.url, key=key, **ASYNC).headers["location"]
    assert until(proxy.url, location, "completed", "failed")["state"] == "completed"
    assert blips and tool.count(key) == 1
    replay = post(proxy.url, key=key)
    assert replay.status_code == 200 and replay.json()["execution"] == 1


def _cut_tool() -> Starlette:
    async def handle(request: Request) -> Response:
        await request.body()
        if request.query_params.get("cut"):

            async def chunks() -> AsyncIterator[bytes]:
                yield b"x" * 1000
                raise RuntimeError("the tool crashed mid-body")

            return StreamingResponse(chunks())
        return Response(b'{"ok":true}', media_type="application/json")

    return Starlette(routes=[Route("/{path:path}", handle, methods=["POST"])])


def test_a_body_cut_short_fails_its_operation_and_the_worker_goes_on(
    make_proxy: ProxyFactory,
) -> None:
    with running(ThreadServer(_cut_tool())) as server:
        proxy = make_proxy(_fault_route(server.url))
        cut = post(proxy.url, query="?cut=1", **ASYNC).headers["location"]
        failed = until(proxy.url, cut, "failed", "completed")
        assert failed["error"]["type"] == "urn:tool-proxy:problem:outcome-unknown"
        after = post(proxy.url, key=new_key(BODY, step=2), **ASYNC).headers["location"]
        assert until(proxy.url, after, "completed", "failed")["state"] == "completed"


def test_a_request_body_that_cannot_be_read_is_retried_and_nothing_leaks(
    tool: CountingTool, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = RouteJobs._body
    failures: list[int] = []

    async def body(self: RouteJobs, request: Any) -> bytes:
        if not failures:
            failures.append(1)
            raise OffloadUnavailable("the object store is down")
        return await original(self, request)

    monkeypatch.setattr(RouteJobs, "_body", body)
    proxy = make_proxy(_fault_route(tool.url))
    key = new_key(BODY)
    location = post(proxy.url, key=key, **ASYNC).headers["location"]
    done = until(proxy.url, location, "completed", "failed", "dead")
    assert (done["state"], done["attempts"]) == ("completed", 2)
    assert tool.count(key) == 1


def test_a_cancel_whose_release_failed_releases_when_sent_again(
    tool: CountingTool, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = MemoryStore.release
    blips: list[str] = []

    async def release(self: MemoryStore, key: Any, owner: str) -> bool:
        if owner.startswith("job.") and not blips:
            blips.append(owner)
            raise StoreUnavailable("blip")
        return await original(self, key, owner)

    monkeypatch.setattr(MemoryStore, "release", release)
    proxy = make_proxy(_fault_route(tool.url))
    busy = post(proxy.url, query="?delay=1", key=new_key(BODY, step=9), **ASYNC)
    until(proxy.url, busy.headers["location"], "running")
    key = new_key(BODY)
    location = post(proxy.url, key=key, **ASYNC).headers["location"]
    assert httpx.delete(proxy.url + location).status_code == 503  # cancelled, key not freed
    again = httpx.delete(proxy.url + location)
    assert again.status_code == 200 and again.json()["state"] == "cancelled"
    resent = post(proxy.url, key=key, **ASYNC)  # a new operation runs the call
    assert resent.status_code == 202 and resent.headers["location"] != location
    assert until(proxy.url, resent.headers["location"], "completed")["attempts"] == 1


def test_a_key_claimed_for_a_job_that_was_never_queued_is_released_for_a_retry(
    tool: CountingTool, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store fails between the claim and the queue, and fails the release too (or
    the proxy dies there): the key is held by a job that does not exist. A retry past
    lock_ttl (1 s) releases it, since nothing was sent, and runs the call once."""
    submit, release = MemoryQueue.submit, MemoryStore.release
    down: list[str] = []

    async def failing_submit(self: MemoryQueue, job: Job) -> Job:
        if not down:
            down.append(job.id)
            raise StoreUnavailable("blip")
        return await submit(self, job)

    async def failing_release(self: MemoryStore, key: Any, owner: str) -> bool:
        if down and owner == JOB_OWNER + down[0] and len(down) == 1:
            down.append("release")
            raise StoreUnavailable("blip")
        return await release(self, key, owner)

    monkeypatch.setattr(MemoryQueue, "submit", failing_submit)
    monkeypatch.setattr(MemoryStore, "release", failing_release)
    proxy = make_proxy(_fault_route(tool.url))
    key = new_key(BODY)
    assert post(proxy.url, key=key, **ASYNC).status_code == 503
    assert down == [down[0], "release"]
    answers: list[httpx.Response] = []

    def accepted() -> bool:
        answers.append(post(proxy.url, key=key, **ASYNC))
        return answers[-1].status_code == 202

    wait_for(accepted, what="a retry to be accepted")
    assert {a.status_code for a in answers[:-1]} <= {409}
    assert until(proxy.url, answers[-1].headers["location"], "completed")["attempts"] == 1
    assert tool.count(key) == 1


def test_a_job_claim_whose_reply_was_lost_is_released_without_a_retry(
    tool: CountingTool, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store applies a job's claim and its reply is lost (the submitter answers
    503), then refuses the release twice: the key is released in the background as soon
    as the store answers, well before lock_ttl (30 s, past which only a retry would have
    released it), and the retry runs the call once."""
    claim, release = MemoryStore.claim, MemoryStore.release
    lost: list[str] = []
    releases: list[bool | None] = []

    async def lossy_claim(
        self: MemoryStore, key: Any, fingerprint: str, owner: str, *a: Any, **k: Any
    ) -> Any:
        claimed = await claim(self, key, fingerprint, owner, *a, **k)
        if owner.startswith(JOB_OWNER) and not lost:
            lost.append(owner)
            raise StoreUnavailable("the reply was lost")
        return claimed

    async def failing_release(self: MemoryStore, key: Any, owner: str) -> bool:
        if lost and owner == lost[0] and len(releases) < 2:
            releases.append(None)
            raise StoreUnavailable("still out of reach")
        done = await release(self, key, owner)
        if lost and owner == lost[0]:
            releases.append(done)
        return done

    monkeypatch.setattr(jobs_module, "UNCLAIM_RETRY_SECONDS", 0.05)
    monkeypatch.setattr(MemoryStore, "claim", lossy_claim)
    monkeypatch.setattr(MemoryStore, "release", failing_release)
    spec = _fault_route(tool.url)
    spec["idempotency"]["lock_ttl"] = "30s"
    proxy = make_proxy(spec)
    key = new_key(BODY)
    assert post(proxy.url, key=key, **ASYNC).status_code == 503
    wait_for(lambda: True in releases, what="the lost claim to be released")
    assert releases == [None, None, True]
    retried = post(proxy.url, key=key, **ASYNC)
    assert retried.status_code == 202
    assert until(proxy.url, retried.headers["location"], "completed")["attempts"] == 1
    assert tool.count(key) == 1


def test_the_async_preferences_are_not_forwarded_to_the_tool(
    tool: CountingTool, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(long_route(tool.url))
    key = new_key(BODY)
    prefer = {"Prefer": "respond-async, wait=1, return=minimal"}
    location = post(proxy.url, key=key, query="?delay=1.5", **prefer).headers["location"]
    until(proxy.url, location, "completed")
    assert tool.requests[-1]["headers"]["prefer"] == "return=minimal"


# -- tool-proxy operations ----------------------------------------------------------------


def test_the_cli_lists_dead_operations_and_requeues_them(
    make_proxy: ProxyFactory, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    tool = FlakyTool(-1)
    with running(ThreadServer(tool.app)) as server:
        store = f"sqlite://{tmp_path}/state.db"
        spec = long_route(server.url, async_={"attempts": 1})
        proxy = make_proxy(spec, store=store)
        config = tmp_path / "proxy.yaml"
        stored = {"url": store, "sealing_key_env": SEALING_ENV}
        config.write_text(yaml.safe_dump({"store": stored, "routes": [spec]}))
        key = new_key(BODY)
        location = post(proxy.url, key=key, **ASYNC).headers["location"]
        dead = until(proxy.url, location, "dead", "completed")
        assert dead["state"] == "dead"

        def cli(*argv: str) -> tuple[int, Any, str]:
            capsys.readouterr()
            code = cli_main(["operations", *argv, "--config", str(config)])
            out, err = capsys.readouterr()
            return code, json.loads(out) if out.strip() else None, err

        code, listed, _ = cli("list", "--state", "dead")
        assert code == 0 and [(o["id"], o["key"]) for o in listed["operations"]] == [
            (dead["id"], key)
        ]
        assert cli("list", "--state", "sleeping")[0] == 2  # a usage error names the flag
        assert "--state" in cli("list", "--state", "sleeping")[2]
        tool.failures = 0
        code, requeued, err = cli("requeue", dead["id"], "--reason", "the tool is fixed")
        assert code == 0 and requeued["state"] == "queued", err
        assert '"job_requeued"' in err and "the tool is fixed" in err  # the audit line
        assert until(proxy.url, location, "completed")["attempts"] == 1
        code, _, err = cli("requeue", dead["id"], "--reason", "again")
        assert code == 1 and "only a dead one" in err
        assert tool.calls[key] == 2


def _operations_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    """``tool-proxy operations ...`` in this process: exit code, JSON output, stderr."""
    capsys.readouterr()
    code = cli_main(["operations", *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else None, err


@pytest.mark.parametrize("store_url", ["memory", "sqlite", "redis"], indirect=True)
def test_the_operations_listing_goes_on_from_its_next_cursor(
    store_url: str,
    tool: CountingTool,
    make_proxy: ProxyFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A page's next_cursor (an operation id, or on Redis a route's shard and "~") is taken
    back by the admin API and the CLI: it was refused as not one (400)."""
    monkeypatch.setenv("ADMIN_TOKEN", "operator-secret")
    specs = [long_route(tool.url), long_route(tool.url, name="other", path_prefix="/other")]
    proxy = make_proxy(*specs, store=store_url, admin={"token_env": "ADMIN_TOKEN"})
    ids = set()
    for step, path in enumerate(("/tools/run", "/other/run"), 1):
        key = new_key(BODY, step)
        sent = {"content-type": "application/json", "idempotency-key": key, **ASYNC}
        accepted = httpx.post(proxy.url + path, content=json.dumps(BODY), headers=sent)
        ids.add(until(proxy.url, accepted.headers["location"], "completed")["id"])
    admin, listed, cursor = {"authorization": "Bearer operator-secret"}, set(), ""
    for _ in range(5):
        page = httpx.get(
            proxy.url + "/_proxy/admin/operations",
            params={"limit": 1, "cursor": cursor},
            headers=admin,
        )
        assert page.status_code == 200, page.text
        listed |= {o["id"] for o in page.json()["operations"]}
        cursor = page.json()["next_cursor"]
        if cursor is None:
            break
    assert listed == ids
    if store_url == "memory://":
        return  # the CLI's store is another process's
    config = tmp_path / "proxy.yaml"
    stored = {"url": store_url, "sealing_key_env": SEALING_ENV}
    config.write_text(yaml.safe_dump({"store": stored, "routes": specs}))
    code, first, err = _operations_cli(capsys, "list", "--config", str(config), "--limit", "1")
    assert code == 0 and first["next_cursor"], err
    code, rest, err = _operations_cli(
        capsys, "list", "--config", str(config), "--cursor", first["next_cursor"], "--all"
    )
    assert code == 0, err
    assert {o["id"] for o in first["operations"] + rest["operations"]} == ids


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["list", "--cursor", "\udcff"], "--cursor: "),  # a byte 0xff from the shell
        (["list", "--cursor", "garbage"], "--cursor: must be the next_cursor"),
        (["list", "--cursor", "0123456789abcdef~x y"], "--cursor: must be the next_cursor"),
        (["list", "--state", "\udcff"], "--state: "),
        (["requeue", "\udcff", "--reason", "x"], "ID: "),
        (["requeue", "garbage", "--reason", "x"], "ID: not an operation id"),
        (["requeue", "OP", "--reason", ""], "--reason: required"),
        (["requeue", "OP", "--reason", "  "], "--reason: required"),
        (["requeue", "OP", "--reason", "\udcff"], "--reason: not UTF-8 text"),
    ],
)
def test_the_operations_cli_names_a_bad_flag_as_the_admin_api_does(
    argv: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked before the store is opened, as the HTTP API checks them: no traceback from
    the store (a lone surrogate), no empty page for a cursor no listing gave, no requeue
    without a reason."""
    config = tmp_path / "proxy.yaml"
    stored = {"url": f"sqlite://{tmp_path}/s.db", "sealing_key_env": SEALING_ENV}
    config.write_text(yaml.safe_dump({"store": stored, "routes": [long_route("http://x:9")]}))
    argv = [new_job_id("tool") if a == "OP" else a for a in argv]
    code, _, err = _operations_cli(capsys, argv[0], "--config", str(config), *argv[1:])
    assert code == 2, err
    assert f"error: {flag}" in err and "Traceback" not in err


# -- the second review's findings -----------------------------------------------------------


def _dead_job_store(backend: str, request: pytest.FixtureRequest) -> tuple[Any, Any]:
    if backend == "memory":
        return MemoryStore(), MemoryQueue()
    from proxy.store.redis import RedisStore

    redis = RedisStore(request.getfixturevalue("redis_url"))
    return redis, redis.queue()


@pytest.mark.anyio
@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_stale_second_requeue_leaves_the_running_jobs_key_alone(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """Two operators requeue one dead operation; the second read it while it was still
    dead, and runs after the first queued it and a worker sent it. The second is refused,
    and the running job's claim stays (releasing it would let a retry run the call again)."""
    spec = route("http://tool:1")
    spec["async"] = {"visibility": "1s"}
    config = parse_config({"store": {"url": "memory://"}, "routes": [spec]}, env={}).routes[0]
    store, queue = _dead_job_store(backend, request)
    try:
        await _requeue_twice(config, store, queue)
    finally:
        await store.close()


async def _requeue_twice(config: Any, store: Any, queue: Any) -> None:
    key = RecordKey("scope|1", "k")
    scope = {"method": "POST", "path": "/t", "query_string": b"", "headers": [], "scheme": "http"}
    blob = encode_request(StoredRequest(scope, b"{}", "fp", ""))
    id = new_job_id(config.name)
    await queue.submit(Job(id, config.name, "", key.slot, key.name, "k", blob, keep=600))
    owner = JOB_OWNER + id
    dead = await queue.move(id, frozenset({JobState.QUEUED}), JobState.DEAD)  # key released
    assert dead is not None
    assert await requeue(dead, config, store, queue) is not None
    assert await queue.take(config.name, "w", 1.0) is not None
    assert await store.renew(key, owner, 10, 600)
    sent = frozenset({JobState.QUEUED})
    assert await queue.move(id, sent, JobState.RUNNING, worker="w", sent=True) is not None
    assert await requeue(dead, config, store, queue) is None  # the stale one
    record = await store.get(key)
    assert record is not None and record.state is State.IN_PROGRESS and record.owner == owner


def test_a_slow_start_never_lets_another_worker_fail_a_call_in_flight(
    tool: CountingTool, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first worker takes most of its hold reading the body (a large one from object
    storage): its hold is renewed before the call is sent, so the second worker does not
    take the job over and record an unknown outcome while the call runs."""
    original = RouteJobs._body
    reads: list[int] = []

    async def slow_body(self: RouteJobs, request: Any) -> bytes:
        reads.append(1)
        if len(reads) == 1:
            await asyncio.sleep(0.25)  # of a 0.3 s hold
        return await original(self, request)

    monkeypatch.setattr(RouteJobs, "_body", slow_body)
    spec = _fault_route(tool.url)
    spec["workers"] = {"concurrency": 2}
    proxy = make_proxy(spec)
    key = new_key(BODY)
    location = post(proxy.url, key=key, query="?delay=1.5", **ASYNC).headers["location"]
    ended = until(proxy.url, location, "completed", "failed", "dead")
    assert ended["state"] == "completed", ended
    assert tool.count(key) == 1


def test_bad_numbers_and_cursors_are_problems_not_errors(
    tool: CountingTool, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADMIN_TOKEN", "operator-secret")
    proxy = make_proxy(long_route(tool.url), admin={"token_env": "ADMIN_TOKEN"})
    location = post(proxy.url, query="?delay=1", **ASYNC).headers["location"]
    stream = {"accept": "text/event-stream"}
    admin = {"authorization": "Bearer operator-secret"}
    answers = {
        "Last-Event-ID ²": httpx.get(
            proxy.url + location,
            headers=[(b"accept", b"text/event-stream"), (b"last-event-id", b"\xb2")],
        ),
        "Last-Event-ID, 5000 digits": httpx.get(
            proxy.url + location, headers={**stream, "last-event-id": "9" * 5000}
        ),
        "limit ²": httpx.get(proxy.url + "/_proxy/admin/operations?limit=%C2%B2", headers=admin),
        "limit, 5000 digits": httpx.get(
            proxy.url + "/_proxy/admin/operations?limit=" + "1" * 5000, headers=admin
        ),
        "cursor ²": httpx.get(proxy.url + "/_proxy/admin/operations?cursor=%C2%B2", headers=admin),
        "cursor, not an operation id": httpx.get(
            proxy.url + "/_proxy/admin/operations?cursor=garbage", headers=admin
        ),
        "records limit ²": httpx.get(
            proxy.url + "/_proxy/admin/records?limit=%C2%B2", headers=admin
        ),
    }
    for name, answer in answers.items():
        assert answer.status_code == 400, name
        assert answer.headers["content-type"] == "application/problem+json", name
        assert answer.json()["type"].endswith("invalid-field"), name
    assert preferences("respond-async, wait=\xb2") == (True, None)


# -- credentials at rest (issue 20, 2.4) ---------------------------------------------------


def test_a_stored_requests_credentials_are_sealed_and_still_reach_the_tool(
    make_proxy: ProxyFactory, tool: CountingTool, tmp_path: Path
) -> None:
    """The job's request waits in the store (SQLite here) with the caller's Authorization
    and Cookie sealed: the store's bytes never hold them, the tool gets them."""
    database = tmp_path / "state.db"
    proxy = make_proxy(long_route(tool.url), store=f"sqlite://{database}")
    secret = {"authorization": "Bearer alice-secret-token", "cookie": "session=alice-cookie"}
    accepted = post(proxy.url, query="?delay=1", **secret, **ASYNC)
    assert accepted.status_code == 202, accepted.text
    wait_for(lambda: tool.in_flight == 1, what="the job at the tool")
    with sqlite3.connect(database) as db:
        (stored,) = db.execute("SELECT request FROM jobs").fetchone()
    assert b'"sealed"' in stored
    assert b"alice-secret-token" not in stored and b"alice-cookie" not in stored
    until(proxy.url, accepted.headers["location"], "completed")
    (sent,) = tool.requests
    assert sent["headers"]["authorization"] == "Bearer alice-secret-token"
    assert sent["headers"]["cookie"] == "session=alice-cookie"


def test_sealed_credentials_are_not_sent_by_a_replica_with_another_key() -> None:
    """A request sealed with one key: a replica with another cannot open it, and the job
    is refused as not sent (another replica with the right key runs it)."""
    scope = {
        "method": "POST",
        "path": "/tools/run",
        "raw_path": b"/tools/run",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer t")],
        "client": ("127.0.0.1", 1),
        "scheme": "http",
    }
    blob = encode_request(StoredRequest(scope, b"{}", "f" * 64, ""), Sealer(b"a" * 32), "job-1")
    assert b"Bearer t" not in blob
    stored = decode_request(blob)
    assert stored.scope["headers"] == [(b"content-type", b"application/json")]
    opened = unsealed(stored, Sealer(b"a" * 32), "job-1")
    assert (b"authorization", b"Bearer t") in opened.scope["headers"]
    with pytest.raises(StoredRequestUnreadable):
        unsealed(stored, Sealer(b"b" * 32), "job-1")
    with pytest.raises(StoredRequestUnreadable):  # bound to its job: not another's
        unsealed(stored, Sealer(b"a" * 32), "job-2")


@pytest.mark.parametrize("store", ["sqlite:///tmp/x.db", "redis://127.0.0.1:6379/0"])
def test_a_persistent_store_needs_a_sealing_key_or_an_explicit_clear(store: str) -> None:
    spec = long_route("http://127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"async\.credentials.*store\.sealing_key_env"):
        parse_config({"store": {"url": store}, "routes": [spec]}, env={})
    spec["async"]["credentials"] = "clear"
    parse_config({"store": {"url": store}, "routes": [spec]}, env={})
    parse_config({"store": {"url": "memory://"}, "routes": [long_route("http://x:9")]}, env={})
